import sys

from trainer_svc.cli import main

sys.exit(main())
