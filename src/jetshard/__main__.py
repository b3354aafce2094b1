from jetshard.cli import main

main()
