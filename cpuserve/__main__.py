from cpuserve.cli import main

raise SystemExit(main())
