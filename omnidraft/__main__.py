from omnidraft.cli import main

main()
