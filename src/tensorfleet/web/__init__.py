"""The HTTP toolkit that every web app of tensorfleet shares: the dashboard, the job service and serve-model.

``bodies``: request bodies bounded in size and time (``BodyLimit``); ``threads``: a uvicorn server in
a background thread of a command whose main thread owns the signals (``bind``, ``serve_in_thread``,
``wait_for_stop_signal``, ``url_host``); ``json_safe``: a value JSON can spell. The apps themselves
live with what they show (``dashboard/``, ``service/``, ``serving/``).
"""

from tensorfleet.web.bodies import BODY_TIMEOUT_S, BodyLimit
from tensorfleet.web.threads import STOP_POLL_S, ThreadServer, bind, serve_in_thread, url_host, wait_for_stop_signal
from tensorfleet.web.values import json_safe

__all__ = ["BODY_TIMEOUT_S", "BodyLimit", "STOP_POLL_S", "ThreadServer", "bind", "json_safe", "serve_in_thread",
           "url_host", "wait_for_stop_signal"]
