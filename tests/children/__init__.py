"""The tests' child processes, one module each, started by `reliability.launch` as
`python -m children.<name> ARGS...` (tests/ is on their PYTHONPATH). Importing one does
nothing: its work is in `main()`, which reads `sys.argv`."""
