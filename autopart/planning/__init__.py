"""Planning: predict and choose plans without running them. ``cluster`` holds hardware
profiles, ``simulate`` costs and replays a schedule for a GPT shape, ``planner`` searches the
plans, ``calibrate`` fits a profile from a measured trace."""
