"""ds4sci.train"""
