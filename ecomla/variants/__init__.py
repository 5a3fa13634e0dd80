"""Attention variants (MHA/GQA/MQA/MLA/LRKV) pretrained from scratch at equal parameters and tokens (`ecomla variants`)."""
