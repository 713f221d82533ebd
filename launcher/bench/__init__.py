"""``hpar bench``: ``config`` names the bench strategies and the bench's settings; ``planning``
profiles each script once, estimates every strategy and writes the plans its runs take;
``driver`` runs each strategy through ``hpar run`` on the same job and reads back measured
figures; ``report`` prints tables, JSON and plots; ``emulate`` makes an emulated cluster of
test hosts with capped links and checks byte accounting against the kernel."""
