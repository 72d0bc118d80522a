from .cli import console

if __name__ == "__main__":  # spawned vLLM workers re-import __main__: run only in the parent
    console()
