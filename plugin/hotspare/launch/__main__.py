"""``python -m hotspare.launch``: hotspare-run."""
import sys

from .cli import main

sys.exit(main())
