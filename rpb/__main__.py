from rpb.pipeline.cli import main

raise SystemExit(main())
