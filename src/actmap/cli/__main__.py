from actmap.cli import main

main()
