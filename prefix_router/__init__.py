"""``prefix-router``: the command line, on top of every package and imported by none.

Each package registers the commands that live in it (``loadtest``: replay,
crossover, calibrate, bench; ``deploy``: replica, gateway, serve, up, status, down,
tiny-model); ``cli`` puts them under one parser.
"""
