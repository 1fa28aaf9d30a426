"""`python -m accelgen`: the `accelgen` command line."""

from accelgen.cli import main

if __name__ == "__main__":
    main()
