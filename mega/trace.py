"""``python -m mega.trace RUN_DIR [--steps a:b] [--out PATH]``: every rank's timeline of a training
run merged into one Chrome trace (Perfetto, chrome://tracing). See mega/obs/trace.py."""

import sys

from mega.obs.trace import main

if __name__ == "__main__":
    sys.exit(main())
