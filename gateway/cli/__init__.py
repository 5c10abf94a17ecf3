"""The `cortex` command line (entry point `gateway.cli.main:main`): `main` parses and runs verbs,
`up` supervises a local stack, `status` prints tables, `run_file` finds the local stack's Redis."""
