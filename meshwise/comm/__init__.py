"""Communication: ``ops`` is the only caller of ``torch.distributed``; the rest builds on it.

``policy`` holds every per-backend choice of formulation, ``timing`` the
device-synchronised clocks, ``devices`` which device a rank uses;
``algorithms`` and ``allreducer`` our all-reduce algorithms, ``compressor``,
``compression`` and ``powersgd`` gradient compression, ``reducer`` the dp
gradient reduction that uses them.
"""
