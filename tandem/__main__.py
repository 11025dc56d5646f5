from tandem.cli import main

raise SystemExit(main())
