from replay.cli import main

main(prog_name="spec-replay")
