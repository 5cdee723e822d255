"""The Synthesizer family (Tay et al., 2021, arXiv:2005.00743) as token mixers: importing this
module adds them to extractor.MIXERS. (Being moved here from extractor.py.)"""
import extractor  # noqa: F401
