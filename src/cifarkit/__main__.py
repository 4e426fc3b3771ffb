from cifarkit.cli import main

raise SystemExit(main())
