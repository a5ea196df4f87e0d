import sys

from rollout_svc.cli import main

sys.exit(main())
