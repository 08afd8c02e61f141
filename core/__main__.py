from plait.cli import run

run()
