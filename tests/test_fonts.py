"""Figures and CJK text: with a CJK font installed, Chinese labels draw with real glyphs; without
one, the figures' labels fall back to English and nothing warns. Both branches render for real
(Agg, PNG); the no-font branch is reached by searching an empty set of installed fonts."""

from __future__ import annotations

import io
import warnings

import matplotlib
import pytest

from trainmech import fonts, plots

pytestmark = pytest.mark.package


@pytest.fixture(autouse=True)
def _restore_fonts():
    saved = list(matplotlib.rcParams["font.family"])
    yield
    matplotlib.rcParams["font.family"] = saved
    fonts.configure()


def _render(fig) -> list[str]:
    """Draw fig to PNG; the warnings drawing raised (matplotlib warns once per missing glyph).
    ResourceWarnings are left out: they come from whatever the garbage collector finalises meanwhile."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig.savefig(io.BytesIO(), format="png")
    return [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)]


def _figure_with(title: str):
    fig = plots.training_loop([3.0, 2.5, 2.25], [0.4, 0.2])
    fig.axes[0].set_title(title)
    return fig


def test_the_first_known_family_wins():
    assert (
        fonts.find_cjk_family({"DejaVu Sans", "WenQuanYi Micro Hei", "Noto Sans CJK JP"})
        == "WenQuanYi Micro Hei"
    )
    assert fonts.find_cjk_family({"DejaVu Sans", "Noto Sans CJK SC", "SimHei"}) == "Noto Sans CJK SC"
    assert fonts.find_cjk_family({"DejaVu Sans"}) is None


def test_without_a_cjk_font_labels_stay_english_and_nothing_warns():
    assert fonts.configure(available=set()) is None
    assert fonts.cjk_family() is None
    assert matplotlib.rcParams["font.family"] == ["sans-serif"]
    title = fonts.label("损失", "loss")
    assert title == "loss"
    assert _render(_figure_with(title)) == []
    # the check above can see tofu: Chinese text without a CJK font warns about missing glyphs
    assert any("missing from font" in w for w in _render(_figure_with("损失")))


def test_with_a_cjk_font_chinese_labels_draw_real_glyphs():
    family = fonts.configure()
    if family is None:
        pytest.skip(
            "no CJK font installed (Debian: apt-get install fonts-wqy-microhei); .ci/run installs one"
        )
    assert matplotlib.rcParams["font.family"] == [
        "sans-serif",
        family,
    ]  # Latin keeps DejaVu Sans; CJK falls back
    title = fonts.label("损失（nats）与参数位移 ‖Δθ‖₂", "loss")
    assert fonts.has_cjk(title)
    assert _render(_figure_with(title)) == []


def test_a_fallback_label_must_be_drawable_without_a_cjk_font():
    with pytest.raises(ValueError, match="fallback label"):
        fonts.label("损失", "损失")
