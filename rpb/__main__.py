from rpb.cli import main

raise SystemExit(main())
