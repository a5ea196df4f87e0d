import sys

from weightsync import fast_exit

fast_exit.arm()  # before the service's imports register their atexit handlers: it runs last

from trainer_svc.cli import main  # noqa: E402

sys.exit(fast_exit.run(main))
