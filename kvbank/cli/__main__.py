"""``python -m kvbank.cli``."""

from kvbank.cli.main import main

raise SystemExit(main())
