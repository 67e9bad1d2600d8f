from ingero.cli import main

raise SystemExit(main())
