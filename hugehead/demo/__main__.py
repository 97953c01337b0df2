"""``python -m hugehead.demo``: run the demo, its time budget counted from the demo's first import."""
import sys

from . import _START, main

sys.exit(main(start=_START))
