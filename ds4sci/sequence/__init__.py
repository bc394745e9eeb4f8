"""ds4sci.sequence"""
