from plait.command import run

run()
