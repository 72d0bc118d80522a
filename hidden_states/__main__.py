import sys

from .cli import main

if __name__ == "__main__":  # spawned vLLM workers re-import __main__: run only in the parent
    sys.exit(main())
