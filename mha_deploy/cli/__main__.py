"""``python -m mha_deploy.cli``: the ``mha-deploy`` command."""

import sys

from mha_deploy.cli import main

# Guarded: tests import every module of the package.
if __name__ == "__main__":
    sys.exit(main())
