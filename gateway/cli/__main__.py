"""`python -m gateway.cli …` is `cortex …`."""

from gateway.cli.main import main

main()
