from jaxckpt.cli import main

main()
