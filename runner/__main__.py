"""Entry point: ``python -m runner +recipe=NAME [overrides]``."""

if __name__ == "__main__":  # also keeps worker processes (which re-import __main__) from running it
    from runner.cli import main

    main()
