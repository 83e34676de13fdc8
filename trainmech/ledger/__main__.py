import sys

from trainmech.ledger.cli import main

sys.exit(main())
