from dsq.cli import main

main()
