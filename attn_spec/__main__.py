import sys

from attn_spec.cli import main

sys.exit(main())
