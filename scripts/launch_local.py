"""Start N jaxpar processes on this machine as one multi-process JAX run (CPU, gloo).

    python scripts/launch_local.py 2 -- train --steps 5 --json

Same as ``jaxpar launch --local N -- ...``; see :mod:`jaxpar.commands.launch`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxpar.cli import main  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) < 2 or not sys.argv[1].isdigit():
        sys.exit("usage: launch_local.py N [--devices-per-process M] -- VERB [ARGS...]")
    sys.exit(main(["launch", "--local", *sys.argv[1:]]))
