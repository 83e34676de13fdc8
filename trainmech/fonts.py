"""A CJK-capable font for the figures, where the machine has one.

matplotlib's default font, DejaVu Sans, has no Chinese glyphs: a Chinese label comes out as empty
boxes (tofu) and one warning per glyph. `configure()` (run when trainmech.plots is imported) looks
for an installed CJK font, including one installed after matplotlib built its font cache, and
adds it to `font.family` after the default family: Latin text, digits and math symbols keep
DejaVu Sans, and matplotlib falls back to the CJK font glyph by glyph.

`label(zh, en)` is how a figure chooses its text: the Chinese label where a CJK font is
configured, the English one where none is, so a figure never shows tofu and never warns.
Install one with the system's package manager, e.g. Debian/Ubuntu `fonts-noto-cjk` or
`fonts-wqy-microhei`; macOS ships PingFang SC.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import matplotlib
from matplotlib import font_manager

__all__ = ["CJK_FAMILIES", "find_cjk_family", "configure", "cjk_family", "has_cjk", "label"]

# Simplified-Chinese faces first; the JP/KR/TC faces of a Noto or Source Han collection hold the same
# ideographs (matplotlib reads a .ttc collection's first face, which for Noto CJK is JP).
CJK_FAMILIES = (
    "Noto Sans CJK SC",
    "Source Han Sans SC",
    "Source Han Sans CN",
    "Noto Sans SC",
    "WenQuanYi Micro Hei",
    "WenQuanYi Zen Hei",
    "PingFang SC",
    "Hiragino Sans GB",
    "Heiti SC",
    "STHeiti",
    "Microsoft YaHei",
    "SimHei",
    "Noto Sans CJK JP",
    "Noto Sans CJK TC",
    "Noto Sans CJK KR",
    "Source Han Sans",
    "Noto Serif CJK SC",
    "Noto Serif CJK JP",
    "Droid Sans Fallback",
    "AR PL UMing CN",
    "AR PL UKai CN",
)
# File names of the fonts above, to find one installed after matplotlib cached its font list.
_CJK_FILE = re.compile(
    r"cjk|wqy|sourcehan|source-han|notosanssc|droidsansfallback|uming|ukai|pingfang|"
    r"hiragino|stheiti|msyh|simhei",
    re.IGNORECASE,
)
_CJK_CHAR = re.compile(r"[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]")

_configured: str | None = None  # the CJK family in use, set by configure()


def _installed_families() -> set[str]:
    """Family names matplotlib can draw with, after registering any CJK font file it has not seen."""
    known = {Path(f.fname) for f in font_manager.fontManager.ttflist}
    for path in font_manager.findSystemFonts():
        if _CJK_FILE.search(Path(path).name) and Path(path) not in known:
            try:
                font_manager.fontManager.addfont(path)
            except (OSError, RuntimeError, ValueError):  # an unreadable file is no candidate
                continue
    return {f.name for f in font_manager.fontManager.ttflist}


def find_cjk_family(available: Iterable[str] | None = None) -> str | None:
    """The first of CJK_FAMILIES among `available` family names (default: the installed fonts)."""
    names = set(_installed_families() if available is None else available)
    return next((family for family in CJK_FAMILIES if family in names), None)


def configure(available: Iterable[str] | None = None) -> str | None:
    """Make the first CJK family found the fallback after the default family; return it, or None.

    `available` limits the search to these family names (tests pass an empty set to get the
    no-font branch). Idempotent: a family configured earlier is replaced, or removed if none is found.
    """
    global _configured
    family = find_cjk_family(available)
    # matplotlib falls back glyph by glyph along font.family (a generic name like "sans-serif"
    # stands for the first installed font of its list): ["sans-serif", <CJK family>].
    families = [f for f in matplotlib.rcParams["font.family"] if f not in CJK_FAMILIES] or ["sans-serif"]
    matplotlib.rcParams["font.family"] = families + ([family] if family else [])
    _configured = family
    return family


def cjk_family() -> str | None:
    """The CJK family the figures use, or None when no CJK font is installed."""
    return _configured


def has_cjk(text: str) -> bool:
    """Whether text holds a CJK character (ideographs, kana, hangul, full-width forms)."""
    return bool(_CJK_CHAR.search(text))


def label(zh: str, en: str) -> str:
    """A figure's text: `zh` where a CJK font is configured, else `en` (ASCII, never tofu).

    Refuses an `en` that itself holds CJK characters: the fallback must draw with any font.
    """
    if has_cjk(en):
        raise ValueError(f"the fallback label {en!r} holds CJK characters; it must draw without a CJK font")
    return zh if _configured is not None else en
