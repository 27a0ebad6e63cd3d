import sys

from tokembed.cli.main import main

sys.exit(main())
