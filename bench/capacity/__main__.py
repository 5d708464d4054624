from bench.common import exit_now

from .run import main

exit_now(main())
