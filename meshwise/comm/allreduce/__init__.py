"""Our all-reduce algorithms from point-to-point transfers (``algorithms``), the
adaptive choice among them (``allreducer``), the dp gradient reduction that uses
them with compression (``reducer``), and ``meshwise bench comm`` (``bench``)."""
