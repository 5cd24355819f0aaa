# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Remote pulls: workers pull only their bytes from trainer-side producers.
Nothing here imports NIXL or Ray on import.

- ``routing``: which producer serves which worker each name, and the
  settings both sides share (also the Ray version gate);
- ``chunks``: a worker's plan cut into pulls (pure functions);
- ``producer``: one trainer rank's producer: gather groups in, packed chunks
  out;
- ``transport``: the one interface a consumer uses to reach producers;
- ``registry``: transports by name ("inprocess", "nixl", "rdt", and the
  "auto" rule), each side made by name, modules imported on first lookup;
- ``nixl``, ``ray``: the two remote transports;
- ``control``: the authenticated JSON control connections ``nixl`` uses.
"""
