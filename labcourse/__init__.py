"""labcourse: the course's own machinery: runs, checks and builds the labs of this repository, renders the figures
they measured into the README, and checks a GPU machine in one command. It imports `labkit`; `labkit` never imports it.
"""
