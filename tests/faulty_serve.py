"""`cpuserve` with faults injected (tests/faults.py); from the repository root:
`python -m tests.faulty_serve serve ...`."""

import sys

from tests.faults import install

install()

from cpuserve.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
