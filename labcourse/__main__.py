from labcourse.cli import main

raise SystemExit(main())
