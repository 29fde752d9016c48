"""`python -m tools.demo`: the one-command demo (tools/demo/demo.py)."""

from tools.demo.demo import main

raise SystemExit(main())
