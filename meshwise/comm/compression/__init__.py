"""Gradient compression with error feedback: what every compressor shares
(``compressor``), fp16 / bf16 / int8 / top-k and the choice by name
(``compressors``), PowerSGD (``powersgd``)."""
