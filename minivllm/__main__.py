from minivllm.cli import main

raise SystemExit(main())
