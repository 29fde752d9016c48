from repack.cli import main

raise SystemExit(main())
