import sys

from .fleet import main

sys.exit(main())
