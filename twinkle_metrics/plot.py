"""``python -m twinkle_metrics.plot``: kept at this path; the code is in ``integrations.plot``."""
from twinkle_metrics.integrations.plot import *  # noqa: F401,F403
from twinkle_metrics.integrations.plot import main

if __name__ == "__main__":
    main()
