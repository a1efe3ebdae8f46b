"""The closed-loop multi-round chat benchmark's parts (lab/chat_rounds.py): users whose every prompt extends
their last one with the model's reply and a new question (loop.py), and its per-round report (report.py). Engines,
cache servers, counters and statistics are the serving benchmark's (lab/serving)."""
