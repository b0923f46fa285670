from tuner.cli import main

raise SystemExit(main())
